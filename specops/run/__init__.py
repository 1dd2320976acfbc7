"""Running an engine: its process group, the instance state on disk, and the supervisor's state machine."""
