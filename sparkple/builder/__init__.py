"""The table builder: a snapshot's safetensors headers planned into the packed PLE table,
its rows streamed into it, verified, and the synthetic checkpoints the tests build from.

Standard library and numpy only (the serving image's Python runs `sparkple build-table`).
"""
