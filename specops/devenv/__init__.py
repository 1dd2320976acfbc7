"""The development environment: CPU engines for tests and demos, and generated test models.
Nothing in the runtime imports it."""
