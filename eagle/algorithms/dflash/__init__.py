"""DFlash (arXiv 2602.06036): the head (`head`), its Algorithm (`algorithm`) and drafting step (`drafting`)."""
