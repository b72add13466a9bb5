"""The federated core: parameter roles, client update, wire casting, aggregation, server optimisers.

Everything here is a pure function of arrays, independent of how clients are executed.
"""
