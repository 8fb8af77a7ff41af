"""Small data sets shipped with ddl_magic for the examples and the demo; read them with
``ddl_magic.labs.datasets``."""
