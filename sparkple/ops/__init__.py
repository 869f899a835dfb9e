"""The host programs' module paths before they moved into supervise/, pair/, metrics/ and
provision/: each runs its program from the new home, so a unit rendered before the move still
starts (until its role renders it again). Kept for one release; nothing in the package imports it.
"""
