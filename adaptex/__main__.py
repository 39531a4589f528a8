"""`python -m adaptex`: the command line."""
from adaptex.launch import run

run()
