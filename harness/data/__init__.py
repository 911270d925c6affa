"""Package data (the tiny offline corpus) so it ships inside the wheel."""
