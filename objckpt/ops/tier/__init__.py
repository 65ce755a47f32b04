"""The node tier's mechanics: what each node's disk holds, peers and replication between
nodes, promotion to the store.
"""
