"""`keel check` and `keel doctor`: judge what the trainer would build, and the machine, before any
weight is loaded."""
