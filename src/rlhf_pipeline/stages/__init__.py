"""One module per stage. Each has a config dataclass, ``main(config)``, and ``cli(argv)``."""
