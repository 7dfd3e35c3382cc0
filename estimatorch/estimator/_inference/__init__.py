"""The inference paths of the estimator: ``evaluate``, ``predict`` and ``fit``'s sanity pass over
``val_data``.
"""
