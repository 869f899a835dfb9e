"""One Spark's serving unit kept up: the memory watchdog, the health probe, the supervisor and its
maintenance relaunch, and the state directory through which they coordinate. Standard library
only: the host's python3 runs them (`python3 -m sparkple.supervise.<program>`).
"""
