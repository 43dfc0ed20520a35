"""Written words as they are said: numbers, money, percentages, times, ordinals, years,
dates, units, symbols, initialisms, web and email addresses, file names, model numbers
and abbreviations spelled out in words before the model reads them (English).

The decoder reads letters. Digits and symbols were rare in its training text and it
babbles them: on 120 sentences full of them, as an assistant's replies are, Whisper's WER
was 94 % read as written and 45 % said in words; on 120 with addresses, file names and
the like, 53 % and 46 % against the words said (docs/eval.md, "Numbers and symbols").

`spoken_words` maps one whitespace-delimited word, as the chunker releases it, to the
words said in its place; the text memory gives the model those (server/text_memory.py),
while word timings and a session's summary keep the written word. A word is read on its
own, as text streams in and a word is whole once whitespace follows it: a reading that
depends on the next word ("No. 5", "5 am") is not made, and "am" stays the verb. Ordinary
words come back unchanged.

The readings are written here, not taken from num2words or inflect: the server's whole
text path then runs on the GPU machines' images, which reach no package index, and
English cardinals, ordinals and years are a few dozen lines.
"""
from __future__ import annotations

import re

from .graphemes import has_content

# the letters and spaces said for a word are at most this many times its characters
# ("777" is "seven hundred seventy seven": 9x), so that what holds a transcript sized
# for a text's characters times this holds the words said for it (the engine's
# guidance ring, models/guidance_batch.py); a reading past it is not made
MAX_EXPANSION = 10
# a longer word is said as written: no reading of one is that long, and the rules' work
# grows with the word (~1.5 ms a thousand characters), on the engine thread every session shares
MAX_READ_CHARS = 256

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10 ** 12, "trillion"), (10 ** 9, "billion"), (10 ** 6, "million"), (1000, "thousand"))
_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
            "nine": "ninth", "twelve": "twelfth"}
_LETTER = dict(zip("abcdefghijklmnopqrstuvwxyz",
                   ("ay", "bee", "see", "dee", "ee", "eff", "gee", "aitch", "eye", "jay", "kay", "el", "em", "en",
                    "oh", "pee", "cue", "ar", "ess", "tee", "you", "vee", "double you", "ex", "why", "zee")))
# money: symbol -> (unit, units, hundredth, hundredths)
_MONEY = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
          "£": ("pound", "pounds", "penny", "pence"), "¥": ("yen", "yen", "", "")}
_MAGNITUDE = {"k": "thousand", "m": "million", "mn": "million", "b": "billion", "bn": "billion", "t": "trillion"}
# unit -> (singular, plural); matched case-sensitively after a number ("5km", "16GB")
_UNITS = {"km": ("kilometer", "kilometers"), "m": ("meter", "meters"), "cm": ("centimeter", "centimeters"),
          "mm": ("millimeter", "millimeters"), "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"),
          "mg": ("milligram", "milligrams"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
          "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"), "l": ("liter", "liters"),
          "L": ("liter", "liters"), "ms": ("millisecond", "milliseconds"), "s": ("second", "seconds"),
          "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour", "hours"), "min": ("minute", "minutes"),
          "mph": ("mile per hour", "miles per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
          "km/h": ("kilometer per hour", "kilometers per hour"), "ft": ("foot", "feet"),
          "mi": ("mile", "miles"), "oz": ("ounce", "ounces"), "sec": ("second", "seconds"),
          "mins": ("minute", "minutes"), "yrs": ("year", "years"), "kbps": ("kilobit per second", "kilobits per second"),
          "Mbps": ("megabit per second", "megabits per second"), "Gbps": ("gigabit per second", "gigabits per second"),
          "KB": ("kilobyte", "kilobytes"), "MB": ("megabyte", "megabytes"), "GB": ("gigabyte", "gigabytes"),
          "TB": ("terabyte", "terabytes"), "Hz": ("hertz", "hertz"), "kHz": ("kilohertz", "kilohertz"),
          "MHz": ("megahertz", "megahertz"), "GHz": ("gigahertz", "gigahertz"), "W": ("watt", "watts"),
          "kW": ("kilowatt", "kilowatts"), "V": ("volt", "volts"), "x": ("times", "times"),
          "°C": ("degree celsius", "degrees celsius"), "°F": ("degree fahrenheit", "degrees fahrenheit"),
          "°": ("degree", "degrees"), "m²": ("square meter", "square meters"),
          "km²": ("square kilometer", "square kilometers"), "cm²": ("square centimeter", "square centimeters"),
          "ft²": ("square foot", "square feet"), "m³": ("cubic meter", "cubic meters")}
# the dot is the abbreviation's, not a sentence's end (kept where it usually ends one)
_ABBREVIATIONS = {"Dr.": "doctor", "Mr.": "mister", "Mrs.": "missus", "Ms.": "miz", "Prof.": "professor",
                  "Jr.": "junior", "Sr.": "senior", "St.": "saint", "Mt.": "mount", "vs.": "versus", "vs": "versus",
                  "etc.": "et cetera.", "e.g.": "for example", "i.e.": "that is", "approx.": "approximately",
                  "Inc.": "incorporated.", "Ltd.": "limited.", "Corp.": "corporation.", "Fig.": "figure",
                  "a.m.": "ay em", "p.m.": "pee em", "pm": "pee em", "AM": "ay em", "PM": "pee em",
                  "24/7": "twenty four seven", "Mr": "mister", "Mrs": "missus", "Ms": "miz",
                  "w/": "with", "w/o": "without", "b/c": "because", "PhD": "pee aitch dee", "Ph.D.": "pee aitch dee",
                  "ft.": "feet", "oz.": "ounces", "lb.": "pounds", "lbs.": "pounds", "avg.": "average",
                  "est.": "estimated", "Ave.": "avenue", "Blvd.": "boulevard", "Rd.": "road", "Apt.": "apartment",
                  "Jan.": "january", "Feb.": "february", "Mar.": "march", "Apr.": "april", "Jun.": "june",
                  "Jul.": "july", "Aug.": "august", "Sep.": "september", "Sept.": "september", "Oct.": "october",
                  "Nov.": "november", "Dec.": "december",
                  "C#": "see sharp", "F#": "eff sharp", ".NET": "dot net"}
_ROMAN = {"I": 1, "V": 5, "X": 10}
# units that are no word of their own, read when written apart from their number
# ("16 GB", "5 km"; in the plural, as a number before them is not seen)
_UNITS_APART = ("ms", "m²", "km²", "ft²", "m³", "km", "kg", "cm", "mm", "mg", "ml", "mL", "mph", "kph", "km/h",
                "KB", "MB", "GB", "TB", "kHz", "MHz", "GHz", "°C", "°F", "kbps", "Mbps", "Gbps")
# said before what follows them ("~5" about five, "±3" plus or minus three)
_PREFIXES = {"~": "about", "≈": "about", "±": "plus or minus", "≤": "at most", "≥": "at least", "<=": "at most",
             ">=": "at least"}
# said between the pieces of a web address, an email address or a file name
_SEPARATORS = {".": "dot", "/": "slash", "-": "dash", "_": "underscore", "@": "at", ":": "colon",
               "?": "question mark", "=": "equals", "&": "and", "#": "hash", "~": "tilde", "+": "plus"}
# a rate's unit after "/" ("$9.99/mo")
_PER_UNITS = {"mo": "month", "yr": "year", "hr": "hour", "h": "hour", "wk": "week", "min": "minute", "sec": "second",
              "s": "second", "d": "day"}
# ½ and its kind: (numerator, denominator)
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅛": (1, 8)}
_POWERS = {"²": "squared", "³": "cubed"}
_SUBSCRIPTS = str.maketrans("₀₁₂₃₄₅₆₇₈₉", "0123456789")
# capitals that begin a word said as a word ("NASA"; "HDMI" is spelled: no English word begins "HD")
_ONSETS = frozenset("""
b c d f g h j k l m n p q r s t v w x y z bl br ch cl cr dr fl fr gl gr kn ph pl pr sc sh sk sl sm sn sp st sw th
tr tw wh wr str spr scr spl squ thr shr sch qu
""".upper().split())
_CAPS_WORDS = frozenset({"JSON"})  # said as words all the same
_LETTER_WORDS = "BCDEFGHJKLMNOPQRSTUVWXYZ"  # a capital alone said as its letter ("plan B"; "A" and "I" are words)
_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
# words with no vowel that are said as words, not spelled ("hmm"; "npm", "pdf", "js" are spelled)
_UNSPELLED = frozenset({"hmm", "hm", "mm", "mmm", "shh", "sh", "psst", "pst", "brr", "grr", "tsk", "pfft", "zzz",
                        "nth", "ps", "st", "nd", "rd", "th"})
# a symbol said as a word on its own or between letters and digits ("#" only before a
# number: "#5"; a markdown heading's "#" and "##" are not said)
_SYMBOLS = {"&": "and", "+": "plus", "=": "equals", "@": "at", "%": "percent", "/": "slash",
            "×": "times", "°": "degrees", "€": "euros", "$": "dollars", "£": "pounds", "π": "pi", "∞": "infinity",
            "≠": "not equal"}
# words of two or three capitals read as words (a shouted "NO", "HOT"), not spelled ("US",
# "IT", "OK", "AI", "TV" are spelled: in capitals they are initialisms more often)
_SHORT_WORDS = frozenset("""
a an and are as at be but by can did do for get go got had has he her hey him his how i if in its let
may me my no nor not now of off oh on one or our out own say see she so the to too two was way we who
why yes yet you all any few new old big bad yay wow ha hi
is up am ask ago age air art bag bed bet bit box boy bus buy car cat cup cut day dog dry due eat egg end
eye far fit fix fly fun gas god got gun hat hit hot ice job joy key kid law lay leg lie lot low mad man
map men mix mom dad odd oil pay pen pet pop put raw red row run sad saw sea set six sit sky son sun tax
tea ten tip top toy try use war wet win won zoo
""".split())

_NUM = r"\d{1,3}(?:,\d{3})+|\d+"
_MONEY_RE = re.compile(rf"([$€£¥])({_NUM})(?:\.(\d+))?([kKmMbBtT]|mn|bn)?")
_PERCENT_RE = re.compile(rf"([-+−]?)({_NUM})(?:\.(\d+))?%")
_ORDINAL_RE = re.compile(rf"({_NUM})(?:st|nd|rd|th|ST|ND|RD|TH)")
_DECADE_RE = re.compile(r"'?(\d{2})?(\d)0'?s")
_TIME_RE = re.compile(r"(\d{1,2}):(\d{2})(?:(a|p)\.?m\.?)?", re.IGNORECASE)
_HOUR_RE = re.compile(r"(\d{1,2})(a|p)\.?m\.?", re.IGNORECASE)
_RANGE_RE = re.compile(rf"({_NUM})[-–]({_NUM})(%|x?)")
# a US-style number: three groups, or two with an exchange not starting with 0 or 1 (a
# range "100-1000" is a range)
_PHONE_RE = re.compile(r"(?:\+?1-)?(?:\d{3}-\d{3}|[2-9]\d{2})-\d{4}")
_RATIO_RE = re.compile(r"(\d+):(\d)")
_MAGNITUDE_RE = re.compile(rf"({_NUM})(?:\.(\d+))?(k|M|B|bn)")
_PER_RE = re.compile(r"([^/]+)/([A-Za-z]+)")
_FRACTION_RE = re.compile(r"(\d)/(\d{1,2})")
_SLASHED_RE = re.compile(r"\d+(?:/\d+)+")
_NUMBER_RE = re.compile(rf"([-+−]?)({_NUM})(?:\.(\d+))?")
_UNIT_RE = re.compile(rf"([-+−]?)({_NUM})(?:\.(\d+))?({'|'.join(sorted(map(re.escape, _UNITS), key=len, reverse=True))})")
_VERSION_RE = re.compile(r"([vV]?)(\d+(?:\.\d+){2,})(?:-([A-Za-z]+\d*))?")
_DOTTED_RE = re.compile(r"(?:[A-Za-z]\.){2,}")
_NUMBERED_RE = re.compile(r"No\.(\d+)")
_BY_RE = re.compile(r"(\d+)x(\d+)")
_AFTER_MONEY_RE = re.compile(rf"({_NUM})(?:\.(\d+))?([$€£¥])")
_VULGAR_RE = re.compile(rf"(\d*)([{''.join(_VULGAR)}])")
_HYPHENATED_RE = re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)+")
_DAYS = {"Mon": "monday", "Tue": "tuesday", "Tues": "tuesday", "Wed": "wednesday", "Thu": "thursday",
         "Thur": "thursday", "Thurs": "thursday", "Fri": "friday", "Sat": "saturday", "Sun": "sunday"}
_DAY_RANGE_RE = re.compile(rf"({'|'.join(_DAYS)})[-–]({'|'.join(_DAYS)})")
_ISO_DATE_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
# a web address, an email address or a file name: a scheme (not said), labels of letters,
# digits, hyphens and underscores joined by dots and ending in letters ("example.com",
# "Node.js", "report_2.pdf"), a path; or a local part and "@" before such a domain
_ADDRESS_RE = re.compile(r"(?:[A-Za-z]+://)?(?:[\w.+-]+@)?[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\d?"
                         r"(?::\d+)?(?:/[\w./~?=&#+-]*)?", re.ASCII)
_ADDRESS_PIECES_RE = re.compile(r"[A-Za-z]+|\d+|[./_@:?=&#~+-]")
_IP_RE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_SLASHED_WORDS_RE = re.compile(r"[A-Za-z]+(?:/[A-Za-z]+)+")
_VOWELLESS_RE = re.compile(r"[bcdfghjklmnpqrstvwxz]{1,5}")
_CAPS_RE = re.compile(r"([A-Z]{2,5})(s?)")
_PIECES_RE = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]+|[&+=@%#/×°]")
_MIXED_RE = re.compile(rf"(?:{_PIECES_RE.pattern}|[-'_.])+")  # pieces, and separators not said
_LEADING = "\"'([{¡¿«“‘"
_TRAILING = "\"')]}.,;:!?…»”’"
# markdown's emphasis and code marks around a word ("**3", "tips**", "`sort()`"): not said,
# so that what they wrap is read ("**$5**" is money); markup alone ("###", "*") is left as
# written (dropped, 120 headed sentences spoke level: docs/eval.md "Numbers and symbols")
_MARKS = "*`_~"


def cardinal(n: int) -> list[str]:
    """n in words, American style ("one hundred twenty three"); past the trillions, digit by digit."""
    if n < 0:
        return ["minus"] + cardinal(-n)
    if n >= 10 ** 15:
        return digits(str(n))
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        return [_ONES[n // 100], "hundred"] + (cardinal(n % 100) if n % 100 else [])
    for size, name in _SCALES:
        if n >= size:
            return cardinal(n // size) + [name] + (cardinal(n % size) if n % size else [])
    raise AssertionError(n)


def ordinal(n: int) -> list[str]:
    words = cardinal(n)
    last = words[-1]
    if last in _ORDINAL:
        last = _ORDINAL[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return words[:-1] + [last]


def year(n: int) -> list[str]:
    """A year as it is said: 1984 nineteen eighty four, 1905 nineteen oh five, 1900
    nineteen hundred, 2005 two thousand five, 2024 twenty twenty four."""
    if not 1000 <= n <= 9999 or 2000 <= n <= 2009 or n % 1000 == 0:
        return cardinal(n)
    hi, lo = divmod(n, 100)
    if lo == 0:
        return cardinal(hi) + ["hundred"]
    return cardinal(hi) + (["oh"] if lo < 10 else []) + cardinal(lo)


def digits(s: str) -> list[str]:
    return [_ONES[int(c)] for c in s if c.isdigit()]


def _plural(words: list[str]) -> list[str]:
    """The last word as a plural ("nineteen nineties", "the two thousands")."""
    last = words[-1]
    last = last[:-1] + "ves" if last == "half" else last[:-1] + "ies" if last.endswith("y") else last + "s"
    return words[:-1] + [last]


def _integer(s: str) -> int:
    return int(s.replace(",", ""))


def _number(whole: str, fraction: str | None = None, *, as_year: bool = True) -> list[str]:
    """A written number: a year where it looks like one (four digits, no separators), digit
    by digit where it starts with 0 or is very long (codes, phone numbers), the decimals
    digit by digit."""
    if len(whole) > 1 and whole.startswith("0"):
        words = digits(whole)
    elif as_year and fraction is None and re.fullmatch(r"1[1-9]\d\d|20\d\d", whole):
        words = year(int(whole))
    elif len(whole.replace(",", "")) > 15:
        words = digits(whole)
    else:
        words = cardinal(_integer(whole))
    return words + (["point"] + digits(fraction) if fraction else [])


def _paired(digits_: str) -> list[str]:
    """A number of four digits said in pairs as a year is ("4090" forty ninety, "1080" ten
    eighty, "2000" two thousand), others as numbers."""
    return year(int(digits_)) if re.fullmatch(r"[1-9]\d{3}", digits_) else _number(digits_, as_year=False)


def _letters(s: str) -> list[str]:
    return [w for c in s.lower() for w in _LETTER[c].split()]


def _money(m: re.Match) -> list[str]:
    unit, units, cent, cents = _MONEY[m.group(1)]
    whole, fraction, magnitude = m.group(2), m.group(3), m.group(4)
    if magnitude:
        return _number(whole, fraction, as_year=False) + [_MAGNITUDE[magnitude.lower()], units]
    n = _integer(whole)
    if fraction is None or len(fraction) > 2 or not cent:
        return _number(whole, fraction, as_year=False) + [unit if n == 1 and not fraction else units]
    c = int(fraction.ljust(2, "0"))
    money = cardinal(n) + [unit if n == 1 else units] if n or not c else []
    change = cardinal(c) + [cent if c == 1 else cents] if c else []
    return money + (["and"] if money and change else []) + change


def _time(hour: int, minute: int | None, half: str | None) -> list[str]:
    words = cardinal(hour)
    if minute:
        words += (["oh"] if minute < 10 else []) + cardinal(minute)
    elif minute == 0 and not half:
        words += ["o'clock"]
    return words + (_letters(half + "m") if half else [])


def _address(core: str) -> list[str]:
    """A web or email address or a file name piece by piece: its scheme not said, "www"
    and vowel-less pieces spelled, a two-letter ending ("io", "py") spelled, the
    separators said ("dot", "slash", "dash", "underscore", "at")."""
    rest = core.split("://", 1)[-1].rstrip("/")
    pieces = _ADDRESS_PIECES_RE.findall(rest)
    out: list[str] = []
    for i, piece in enumerate(pieces):
        if piece in _SEPARATORS:
            out.append(_SEPARATORS[piece])
        elif piece.isdigit():
            out += _number(piece, as_year=False)
        elif len(piece) == 1 or (len(piece) == 2 and i > 0 and pieces[i - 1] == "."
                                 and (i + 1 == len(pieces) or pieces[i + 1] in "/:")):
            out += _letters(piece)
        else:
            out += _core(piece) or [piece.lower() if piece.isupper() and len(piece) > 5 else piece]
    return out


def _is_plain(core: str) -> bool:
    """Whether a word is an ordinary one, said as written: letters, lower case or
    capitalised, with a vowel, no abbreviation or unit (most words: read in ~1 us rather
    than through every rule)."""
    return (core.isascii() and core.isalpha() and (core.islower() or (len(core) > 1 and core[0].isupper()
                                                                   and core[1:].islower()))
            and any(c in "aeiouy" for c in core.lower()) and core not in _ABBREVIATIONS and core not in _UNITS_APART)


def _clock(core: str) -> list[str] | None:
    """A clock time ("5:30", "5:30pm", "10am") in words, or None."""
    if m := _TIME_RE.fullmatch(core):
        hour, minute = int(m.group(1)), int(m.group(2))
        if hour <= 24 and minute < 60:
            return _time(hour, minute, m.group(3) and m.group(3).lower())
    if (m := _HOUR_RE.fullmatch(core)) and int(m.group(1)) <= 12:
        return _time(int(m.group(1)), None, m.group(2).lower())
    return None


def _part(piece: str) -> list[str]:
    """A piece of a word joined by "/", "-" or digits: a letter alone spelled ("A/B", "USB-C"),
    any other piece as its own word is said."""
    return _letters(piece) if len(piece) == 1 else _core(piece) or [piece]


def _fraction_name(a: int, b: int) -> list[str]:
    """The name of a/b's parts ("half", "thirds")."""
    name = {2: ["half"], 4: ["quarter"]}.get(b) or ordinal(b)
    return _plural(name) if a > 1 else name


def _roman(s: str) -> int | None:
    """A roman numeral of I, V and X in its usual form (2 to 39), or None."""
    values = [_ROMAN[c] for c in s]
    n = sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))
    usual = "".join(("X" * (n // 10), ("", "I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX")[n % 10]))
    return n if usual == s else None


def _sign(s: str) -> list[str]:
    return {"-": ["minus"], "−": ["minus"], "+": ["plus"]}.get(s, [])


def _core(core: str) -> list[str] | None:
    """The words said for a word without its leading and trailing punctuation, or None: as written."""
    if _is_plain(core):
        return None
    core = core.translate(_SUBSCRIPTS)  # "CO₂"
    if core in _ABBREVIATIONS:
        return _ABBREVIATIONS[core].split()
    if core in _SYMBOLS:
        return _SYMBOLS[core].split()
    if core in _UNITS_APART:
        return _UNITS[core][1].split()
    for prefix, said in _PREFIXES.items():
        if core.startswith(prefix) and len(core) > len(prefix) and (rest := _core(core[len(prefix):])):
            return said.split() + rest
    if m := _MONEY_RE.fullmatch(core):
        return _money(m)
    if m := _PERCENT_RE.fullmatch(core):
        return _sign(m.group(1)) + _number(m.group(2), m.group(3), as_year=False) + ["percent"]
    if m := _ORDINAL_RE.fullmatch(core):
        return ordinal(_integer(m.group(1)))
    if m := _DECADE_RE.fullmatch(core):
        century, decade = m.group(1), int(m.group(2))
        if century:
            return _plural(year(int(century) * 100 + decade * 10))
        return _plural(cardinal(decade * 10)) if decade else None
    if said := _clock(core):
        return said
    if (m := re.fullmatch(r"(.+?)[-–](.+)", core)) and (start := _clock(m.group(1))) and (end := _clock(m.group(2))):
        return start + ["to"] + end  # "10am-2pm"
    if m := _NUMBERED_RE.fullmatch(core):  # "No.1"
        return ["number"] + _number(m.group(1), as_year=False)
    if m := _BY_RE.fullmatch(core):  # "4x4", "1920x1080" nineteen twenty by ten eighty
        return _paired(m.group(1)) + ["by"] + _paired(m.group(2))
    if m := _AFTER_MONEY_RE.fullmatch(core):  # "5€"
        return _money(_MONEY_RE.fullmatch(m.group(3) + m.group(1) + (f".{m.group(2)}" if m.group(2) else "")))
    if m := _DAY_RANGE_RE.fullmatch(core):  # "Mon–Fri"
        return [_DAYS[m.group(1)], "to", _DAYS[m.group(2)]]
    if m := _ISO_DATE_RE.fullmatch(core):
        y, month, day = (int(g) for g in m.groups())
        if 1 <= month <= 12 and 1 <= day <= 31:
            return [_MONTHS[month - 1]] + ordinal(day) + year(y)
    if _PHONE_RE.fullmatch(core):  # a phone number: its digits, group by group
        return [w for group in core.lstrip("+").split("-") for w in digits(group)]
    if m := _RANGE_RE.fullmatch(core):
        return (_number(m.group(1)) + ["to"] + _number(m.group(2))
                + (["percent"] if m.group(3) == "%" else ["times"] if m.group(3) else []))
    if m := _RATIO_RE.fullmatch(core):
        return cardinal(int(m.group(1))) + ["to"] + cardinal(int(m.group(2)))
    if m := _MAGNITUDE_RE.fullmatch(core):
        return _number(m.group(1), m.group(2), as_year=False) + [_MAGNITUDE[m.group(3).lower()]]
    if (m := _PER_RE.fullmatch(core)) and (money := _MONEY_RE.fullmatch(m.group(1))):  # "$5/month"
        return _money(money) + ["per", _PER_UNITS.get(m.group(2), m.group(2))]
    if len(core) > 1 and set(core) <= set(_ROMAN) and (n := _roman(core)):  # "World War II"
        return cardinal(n)
    if m := _FRACTION_RE.fullmatch(core):
        a, b = int(m.group(1)), int(m.group(2))
        if 0 < a < b <= 10:
            return cardinal(a) + _fraction_name(a, b)
    if m := _VULGAR_RE.fullmatch(core):  # "½", "1½"
        a, b = _VULGAR[m.group(2)]
        part = (["a"] if a == 1 else cardinal(a)) + _fraction_name(a, b)
        return cardinal(_integer(m.group(1))) + ["and"] + part if m.group(1) else cardinal(a) + _fraction_name(a, b)
    if _IP_RE.fullmatch(core):
        return [w for i, p in enumerate(core.split(".")) for w in (["dot"] if i else []) + cardinal(int(p))]
    if _SLASHED_WORDS_RE.fullmatch(core):  # "A/B" ay bee, "input/output": the slash not said
        return [w for p in core.split("/") for w in _part(p)]
    if _SLASHED_RE.fullmatch(core):  # dates, versions: each number, "slash" between
        parts = [_number(p) for p in core.split("/")]
        return [w for i, p in enumerate(parts) for w in (["slash"] if i else []) + p]
    if m := _NUMBER_RE.fullmatch(core):
        return _sign(m.group(1)) + _number(m.group(2), m.group(3))
    if m := _UNIT_RE.fullmatch(core):  # "5km", "-5°C"
        singular, plural = _UNITS[m.group(4)]
        one = m.group(2) == "1" and not m.group(3)
        return _sign(m.group(1)) + _number(m.group(2), m.group(3), as_year=False) + (singular if one else plural).split()
    if m := _VERSION_RE.fullmatch(core):  # "1.2.3", "v2.0.1": each number, "point" between
        parts = [_number(p, as_year=False) for p in m.group(2).split(".")]
        suffix = (_core(m.group(3)) or [m.group(3)]) if m.group(3) else []  # "-beta", "-rc1"
        return _letters(m.group(1)) + [w for i, p in enumerate(parts) for w in (["point"] if i else []) + p] + suffix
    if core[-1:] in _POWERS and len(core) > 1:  # "x²" ex squared, "10³", "π²"
        stem = core[:-1]
        letters = stem.isascii() and stem.isalpha()
        base = _letters(stem) if letters and len(stem) == 1 else _core(stem) or ([stem] if letters else None)
        if base:
            return base + [_POWERS[core[-1]]]
    if _DOTTED_RE.fullmatch(core):
        return _letters(core.replace(".", ""))
    if _ADDRESS_RE.fullmatch(core) and not core[0] == ".":
        return _address(core)
    if re.fullmatch(r"\.[A-Za-z]\w*(?:\.\w+)*", core):  # a dotfile (".env", ".env.example")
        return ["dot"] + _address(core[1:])
    if core[:1] == "." and core[1:2].isdigit() and (said := _core("0" + core)) and said[0] == "zero":
        return said[1:]  # ".5" point five, ".5%"
    if (_VOWELLESS_RE.fullmatch(core) and core not in _UNSPELLED) or (len(core) == 1 and core in _LETTER_WORDS):
        return _letters(core)  # no vowel to say it by ("npm", "pdf"), or a letter ("plan B")
    if m := _CAPS_RE.fullmatch(core):
        caps, plural = m.groups()
        onset = re.match(r"[^AEIOUY]*", caps).group()
        said_as_word = onset in _ONSETS or not onset or caps in _CAPS_WORDS
        if (len(caps) <= 3 and caps.lower() not in _SHORT_WORDS) or onset == caps or not said_as_word:
            words = _letters(caps)
            return words[:-1] + [words[-1] + plural]
        return None
    if _HYPHENATED_RE.fullmatch(core) and any(p.isupper() for p in core.split("-")):  # "USB-C", "T-shirt"
        return [w for p in core.split("-") for w in _part(p)]
    if re.search(r"\d|[&+=@%#×°]", core) and re.search(r"[\dA-Za-z]", core) and _MIXED_RE.fullmatch(core):
        # letters, digits and symbols run together ("H100", "COVID-19", "R&D", "3D", "v2"):
        # each run read on its own; a hyphen or dot between them is not said
        out: list[str] = []
        pieces = _PIECES_RE.findall(core)
        for i, piece in enumerate(pieces):
            if piece == "#":
                out += ["number"] if i + 1 < len(pieces) and pieces[i + 1][0].isdigit() else []
            elif piece[0].isdigit():  # a model number's four digits in pairs ("RTX4090" forty ninety)
                out += _number(*piece.split("."), as_year=False) if "." in piece else _paired(piece)
            elif piece in _SYMBOLS:
                out += _SYMBOLS[piece].split()
            else:
                out += _part(piece)
        return out
    return None


def _unmarked(word: str, about: bool = False) -> str:
    """The word without the emphasis and code marks among its leading and trailing
    punctuation ("**Note:**" "Note:", "(`x`)" "(x)"); `about`: a "~" before a digit or
    a currency is kept ("~5": about five)."""
    start, end = 0, len(word)
    while start < end and (word[start] in _LEADING or word[start] in _MARKS):
        if about and word[start] == "~" and start + 1 < end and (word[start + 1].isdigit() or word[start + 1] in _MONEY):
            break
        start += 1
    while end > start and (word[end - 1] in _TRAILING or word[end - 1] in _MARKS):
        end -= 1
    strip = lambda s: "".join(c for c in s if c not in _MARKS)  # noqa: E731
    return strip(word[:start]) + word[start:end] + strip(word[end:])


def spoken_words(word: str) -> list[str]:
    """The words said for one written word (no whitespace in it), its leading
    punctuation on the first and its trailing punctuation on the last; [word] where it
    is said as written."""
    if len(word) > MAX_READ_CHARS:
        return [word]
    if "](" in word and not word.startswith("]("):
        # a markdown link's end ("docs](https://example.com)."): its text is said, not its address
        text, _, target = word.partition("](")
        word = text + (target[target.index(")") + 1:] if ")" in target else "")
    if any(c in word for c in _MARKS):
        unmarked = _unmarked(word)
        if not has_content(unmarked):
            return [word]
        if "~" in word and (about := _unmarked(word, about=True)) != unmarked and (said := _said(about)):
            return said
        word = unmarked
    return _said(word) or [word]


def _said(word: str) -> list[str] | None:
    """`spoken_words` of a word without marks; None: as written."""
    start, end = 0, len(word)
    while start < end and word[start] in _LEADING:
        start += 1
    while end > start and word[end - 1] in _TRAILING:
        end -= 1
    # a trailing dot may be an abbreviation's ("Dr.", "e.g.", "U.S."), or a sentence's end ("42.")
    said = None
    dotted = word[start:end + 1]
    if end < len(word) and word[end] == "." and (dotted in _ABBREVIATIONS or _DOTTED_RE.fullmatch(dotted)):
        said, end = _core(dotted), end + 1
    if said is None and re.fullmatch(r"\(\d{3}\)", word):  # an area code: "(800)"
        said, start, end = digits(word), 0, len(word)
    if said is None:
        said = _core(word[start:end])
    if not said or len(" ".join(said)) > MAX_EXPANSION * len(word):
        return None
    return [word[:start] + said[0]] + said[1:-1] + [said[-1] + word[end:]] if len(said) > 1 \
        else [word[:start] + said[0] + word[end:]]
