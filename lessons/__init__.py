"""The course: the numbered lessons (NN-name.md), their exercises and solutions, and the code that
runs them, `course` (listing, running and comparing the lessons' commands) and `checks` (the
exercises' checkers). `refpar lesson` and the app's Lessons page read them from here.
"""
