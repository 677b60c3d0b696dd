"""`python -m cli ...`: the same command line as the `tandem` console script."""

from cli.main import main

if __name__ == "__main__":  # a spawned multiprocessing child imports this module as __mp_main__: not a second run
    main()
