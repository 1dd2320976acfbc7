"""Configuration: the profile (pydantic models and rules), its YAML source with locations, durations,
and the generated field reference. Imports only the base modules (errors, paths, methods, ...)."""
