"""tfprofd's metric producers: one collector module per source, and the in-process training hook."""
