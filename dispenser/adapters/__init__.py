"""Adapters: the only modules that import drivers, and where their exceptions become ours."""
