"""What plain and speculative decoding share, below every model (it imports none of them): the sampling parameters
and the one sampling transform (``sampling.py``), the thinking budget (``thinking.py``) and the one plain driver
(``plain.py``: ``plain_generate`` over a ``DecodeBackend``; the reference's and the TT model's backends implement it).
"""
