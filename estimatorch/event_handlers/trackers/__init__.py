"""The experiment trackers (``MLflowHandler``, ``WandbHandler``) and the base they share
(``_base``): each tracker's module supplies only a session that opens, writes and ends its run.
"""
