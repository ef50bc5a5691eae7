"""`python -m dion3_titan` is `python -m dion3_titan.train` (torchtitan's trainer + plugin)."""

from dion3_titan.train import main

if __name__ == "__main__":
    main()
