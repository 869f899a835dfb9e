"""Two Sparks serving one model at TP 2: the pair's plan from the inventory, the link and its
checks, the link benchmark and counters, and the pair's supervisors with the link between them.
Standard library only on import (the link benchmark imports torch when it runs, in the image).
"""
