"""The command line: ``sandlock run`` (:mod:`.run`, no click) and every other command (:mod:`.main`)."""
