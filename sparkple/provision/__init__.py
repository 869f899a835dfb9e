"""Tools the roles run while provisioning a host, never by a running host program: the kernel's
tunables applied live and given back (`python3 -m sparkple.provision.sysctl`).
"""
