"""P-EAGLE (arXiv 2602.01469): the head (`head`), its Algorithm (`algorithm`) and drafting step (`drafting`)."""
