"""kvd-loadgen: plays engines against a live kvd and measures what memory does to them."""
