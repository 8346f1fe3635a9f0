"""The build steps: one module per stage, each a function of declared config and input artifacts."""
