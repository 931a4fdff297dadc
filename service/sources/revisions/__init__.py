"""Revisions: the content commit a model's files name, which held revision ``ID@R`` picks,
and the stores published revisions are committed into."""
