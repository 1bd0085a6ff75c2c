"""Ray actors hosting rayspec models (the only Ray-dependent code besides ``jobs``)."""
