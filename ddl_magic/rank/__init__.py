"""The rank side: the process that runs the user's code, and what starts it.

`factory` is the warm process that local ranks fork from; `spark_task` is the body of a Spark
barrier task, the parent of its rank; `worker` is the rank's bootstrap (connect to the
driver, join the ring, run the task, report); `environment` sets the variables torch and
Horovod code read. Never imports the driver, the launchers, the front-ends or the UI.
"""
