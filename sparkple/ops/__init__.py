"""The host programs: memory watchdog, supervisor, health probe, metrics, shared-memory cleanup
and live sysctls. Standard library only (plus this package): the host's python3 runs them as
`python3 -m sparkple.ops.<program>` from the copy on the root file system.
"""
