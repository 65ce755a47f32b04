"""Running a job: the manager and its save path, the step catalog, where each save goes on
the local tier, what follows a commit (backups, retention), restore and rollback, and
the config file.
"""
