"""Reports of a check: the terminal table (text.py), JSON, JUnit XML and error heat maps, and
the states a stage can be in (states.py).
"""
