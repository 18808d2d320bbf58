"""python -m glm_asr.bulk: the command line (cli.main); the task functions stay in their modules,
so they pickle by reference."""
from glm_asr.bulk.cli import main

main()
