"""The MLflow tracker: a plugin on the training thread (tracker) and a background writer that journals and delivers."""
