"""One readable file per parallel strategy, in the lecture's order.

data_parallel.py  zero.py  tensor_parallel.py  pipeline.py (+ simulator.py)  ...
"""
