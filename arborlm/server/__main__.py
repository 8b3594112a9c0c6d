"""`python -m arborlm.server [options]`: the same as `arborlm serve [options]`."""

if __name__ == "__main__":
    from arborlm.server.cli import main

    main()
