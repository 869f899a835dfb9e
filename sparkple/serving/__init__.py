"""The serving plan of one Spark: the recipe (vLLM's flags and argv), the memory budget with the
launch gate, and the two commands the role runs with the host's python3. Standard library only.
"""
