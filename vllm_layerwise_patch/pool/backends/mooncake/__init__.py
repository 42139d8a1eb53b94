"""The distributed backend on Mooncake Store (:mod:`.backend`): the
connection to the master, block objects, and their readers."""
