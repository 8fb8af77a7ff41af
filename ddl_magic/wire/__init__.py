"""What crosses between the driver and a rank: both sides import it, it imports neither.

`channel` frames pickled messages and proves the run's secret before unpickling anything;
`messages` lists every message; `tasks` is the work a rank is given; `output_lines` splits a
rank's output into lines to send; `liveness` is how a rank's parent reports its state and how
the driver judges it.
"""
