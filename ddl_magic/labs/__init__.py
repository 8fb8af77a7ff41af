"""What the teaching labs in example_notebooks/ need: small offline data sets (`datasets`,
public as `ddl_magic.datasets`) and their files (`data/`)."""
