"""The application: the entry's run loop (`execute`), jobs and sweeps, launchers, the console, trackers."""
