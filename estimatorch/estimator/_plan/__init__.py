"""The run's plan: how many batches and optimizer steps a fit takes, known before it starts, and
the learning-rate schedules sized from it.
"""
