"""How bytes move: a communicator per process set, with the same interface for every backend.

All methods are called from the engine thread only, in the same order on every member rank.
Reduction methods receive arrays of a dtype the backend reduces natively (the engine stages
float16/bfloat16 through float32); data-movement methods accept any dtype.
"""
