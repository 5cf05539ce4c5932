"""The text `localrun quantize` scores a new quant on when no --eval-text is given.

Plain English prose written for this project (no copyrighted source), varied in
topic so that no single kind of token dominates; about 700 tokens for a byte-level BPE
vocabulary, enough for a few 128-token chunks. Pass --eval-text with a text of your
own domain for a number that reflects it.
"""

DEFAULT_EVAL_TEXT = """\
The harbour was quiet in the early hours. A single crane stood against the pale sky, \
and the only sound came from the ropes knocking against the masts of the small boats. \
At six o'clock the first lorries arrived, their headlights still on, and men in orange \
jackets began to unload crates of oranges, coffee and machine parts onto the concrete.

Building a stone wall without mortar is an old craft. The builder sorts the stones by \
size before starting, keeps the largest for the base, and sets each stone so that it \
rests on two below it. The wall leans slightly inward as it rises, which lets gravity \
hold it together. A well made dry stone wall can stand for two hundred years.

When water is heated it expands, and when it freezes it expands again, which is unusual: \
most substances shrink as they become solid. Because ice is lighter than liquid water, \
lakes freeze from the top down, and the ice forms a lid that keeps the water beneath it \
from freezing further. Fish survive the winter in the dark, cold water under that lid.

The small bookshop on the corner had been open for thirty years. Its owner knew most of \
her customers by name and kept a notebook of what each of them liked: detective stories \
for the retired teacher, books about birds for the boy from the farm, poetry for the \
nurse who came in every Friday after her night shift. She rarely had to check the list.

A bicycle is a remarkably efficient machine. A rider on a flat road can travel five \
times faster than on foot while using less energy, because the wheels roll with very \
little friction and the gears let the legs turn at a comfortable pace. Keeping the \
tyres pumped and the chain clean makes a larger difference than most riders expect.

At the end of the season the orchard was full of ladders. Pickers worked from the \
bottom branches up, twisting each apple gently so that the stem stayed attached, and \
laid the fruit in canvas bags hung across their chests. The best apples went to the \
market in town; the bruised ones were pressed into juice the same afternoon.

Clocks in old railway stations were once set by telegraph. Every day at noon a signal \
travelled down the line from the main observatory, and station masters adjusted their \
clocks to match it, so that trains hundreds of kilometres apart ran on the same time. \
Before that, each town kept its own local time, set by the sun.

The recipe for the soup was simple: onions softened slowly in butter, a few potatoes, \
a handful of leeks, water, salt and pepper. It simmered for half an hour before being \
blended smooth, and a spoonful of cream went into each bowl at the table. Children who \
claimed to hate leeks asked for a second bowl without knowing what was in it.
"""
