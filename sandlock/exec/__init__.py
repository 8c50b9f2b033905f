"""Starting confined processes: the child's steps, the wire to helper processes, the executors."""
