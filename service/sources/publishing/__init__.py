"""Uploads committed as revisions: the publisher and the patches applied onto a base."""
