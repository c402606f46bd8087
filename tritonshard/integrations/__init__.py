"""Glue for training frameworks that drive an optimizer in ways a sharded one needs help with. Each submodule imports
its framework lazily: tritonshard itself depends on torch and Triton only."""
