"""The data dir bounded in bytes and days (PROTOCOL 8.4): ``plan`` decides, in a thread,
which ended runs to delete; ``loop`` applies it on the broker's loop. Nothing is re-exported.
"""
