"""`python -m bench.curve`: the learning curve (bench.curve.run)."""

from bench.curve.run import main

if __name__ == "__main__":
    main()
