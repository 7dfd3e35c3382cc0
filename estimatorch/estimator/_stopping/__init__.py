"""Stopping, signals and rank failure: SIGINT/SIGTERM deferred to a step boundary, the ranks'
agreement on a stop, the watch on other ranks' failure, and an out-of-memory error told where it
happened.
"""
