"""The run's state: where the loop stands and what a resume needs (the snapshot), and the payload a
checkpoint store moves, mapped onto another world size for an elastic resume.
"""
