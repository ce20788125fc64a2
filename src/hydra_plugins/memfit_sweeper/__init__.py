"""memfit's budget sweeper, a Hydra plugin: hydra/sweeper=memfit (or sweep=budget)."""
