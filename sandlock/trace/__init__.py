"""Recording what a confined tool touched (``sandlock trace``), and drafting a policy from it
(``sandlock learn``)."""
