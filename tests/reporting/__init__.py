"""Progress display and loss-curve tests."""
