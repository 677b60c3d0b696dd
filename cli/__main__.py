"""`python -m cli ...`: the same command line as the `tandem` console script."""

from cli.main import main

main()
