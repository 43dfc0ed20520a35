"""Written words as they are said (models/spoken_form.py)."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from livespeech.models.spoken_form import MAX_EXPANSION, MAX_READ_CHARS, cardinal, ordinal, spoken_words, year

READINGS = {
    # numbers; four digits are a year, separated or signed ones are not
    "0": "zero", "7": "seven", "42": "forty two", "777": "seven hundred seventy seven", "100": "one hundred", "115": "one hundred fifteen",
    "1,200": "one thousand two hundred", "1,000,000": "one million", "3.14": "three point one four",
    "-5": "minus five", "007": "zero zero seven", "2024": "twenty twenty four", "1984": "nineteen eighty four",
    "1905": "nineteen oh five", "1900": "nineteen hundred", "2005": "two thousand five", "2000": "two thousand",
    "3000": "three thousand", "12345678901234567": "one two three four five six seven eight nine zero one two "
                                                    "three four five six seven",
    # money, percentages, ordinals, decades, ranges, fractions, dates
    "$42.50": "forty two dollars and fifty cents", "$1": "one dollar", "$0.99": "ninety nine cents",
    "$5.5": "five dollars and fifty cents", "$1.5M": "one point five million dollars",
    "$10k": "ten thousand dollars", "€20": "twenty euros", "£1.01": "one pound and one penny",
    "45%": "forty five percent", "-3.5%": "minus three point five percent", "1st": "first",
    "22nd": "twenty second", "3rd": "third", "11th": "eleventh", "12th": "twelfth", "20th": "twentieth",
    "1990s": "nineteen nineties", "80s": "eighties", "2000s": "two thousands", "3-5": "three to five",
    "1/2": "one half", "3/4": "three quarters", "2/3": "two thirds",
    "12/05/2026": "twelve slash zero five slash twenty twenty six",
    # times
    "5:30": "five thirty", "5:05": "five oh five", "5:00": "five o'clock", "5:30pm": "five thirty pee em",
    "10am": "ten ay em", "p.m.": "pee em",
    # units, symbols, letters with digits, initialisms, abbreviations
    "5km": "five kilometers", "1kg": "one kilogram", "16GB": "sixteen gigabytes", "2.5x": "two point five times",
    "30°C": "thirty degrees celsius", "&": "and", "#1": "number one", "H100": "aitch one hundred",
    "R&D": "ar and dee", "GPT-4o": "gee pee tee four oh", "COVID-19": "COVID nineteen", "AI": "ay eye",
    "APIs": "ay pee eyes", "HTTP": "aitch tee tee pee", "U.S.": "you ess", "OK": "oh kay", "Dr.": "doctor",
    "e.g.": "for example", "vs.": "versus", "#hashtag": "hashtag", "Q&A": "cue and ay",
    # roman numerals, phone numbers, ratios, magnitudes, rates
    "II": "two", "VIII": "eight", "XIV": "fourteen", "IX": "nine", "555-1234": "five five five one two three four",
    "1-800-555-1234": "one eight zero zero five five five one two three four",
    "555-123-4567": "five five five one two three four five six seven", "3:1": "three to one",
    "100-1000": "one hundred to one thousand",
    "5-10%": "five to ten percent", "1.5k": "one point five thousand", "2M": "two million", "5m": "five meters",
    "60km/h": "sixty kilometers per hour", "$5/month": "five dollars per month", "24/7": "twenty four seven",
    "6ft": "six feet", "100Mbps": "one hundred megabits per second", "GB": "gigabytes", "km": "kilometers",
    "°C": "degrees celsius",
    # web and email addresses, file names, dates, letters without a vowel, prefixes
    "https://example.com/docs": "example dot com slash docs",
    "www.google.com": "double you double you double you dot google dot com",
    "john.smith@gmail.com": "john dot smith at gmail dot com", "Node.js": "Node dot jay ess",
    "report_final.pdf": "report underscore final dot pee dee eff", "README.md": "readme dot em dee",
    "github.com/user/repo-name": "github dot com slash user slash repo dash name",
    "example.io/a?id=3": "example dot eye oh slash ay question mark id equals three",
    "192.168.1.1": "one hundred ninety two dot one hundred sixty eight dot one dot one",
    "2023-10-05": "october fifth twenty twenty three", "1999-12-31": "december thirty first nineteen ninety nine",
    "npm": "en pee em", "mp3": "em pee three", "B": "bee", "X": "ex", "A/B": "ay bee",
    "AI/ML": "ay eye em el", "and/or": "and or", "input/output": "input output", "C#": "see sharp",
    ".NET": "dot net", "Mr": "mister",
    "~5": "about five", "±3": "plus or minus three", "<=10": "at most ten", "≥18": "at least eighteen",
    "10ms": "ten milliseconds", "ms": "milliseconds",
    # product names and model numbers, hyphenated initialisms, abbreviations with a dot,
    # rates, ranges, sizes, fractions, money after its number, subscripts
    "RTX4090": "ar tee ex forty ninety", "FY2024": "eff why twenty twenty four", "1080p": "ten eighty pee",
    "USB-C": "you ess bee see", "T-shirt": "tee shirt", "A-list": "ay list", "HDMI": "aitch dee em eye",
    "No.1": "number one", "Jan.": "january", "ft.": "feet", "w/o": "without", "PhD": "pee aitch dee",
    "$9.99/mo": "nine dollars and ninety nine cents per month", "10am-2pm": "ten ay em to two pee em",
    "2-3x": "two to three times", "1920x1080": "nineteen twenty by ten eighty", "4x4": "four by four",
    "½": "one half", "1½": "one and a half", "5€": "five euros", "20.50€": "twenty euros and fifty cents",
    "50m²": "fifty square meters", "m²": "square meters", "CO₂": "see oh two",
    ".env.example": "dot env dot example", ".5": "point five", ".5%": "point five percent",
    "(800)": "eight zero zero",
    "Mon–Fri": "monday to friday", "-5°C": "minus five degrees celsius", "−10°C": "minus ten degrees celsius",
    "1.2.3": "one point two point three", "v3.0.1-beta": "vee three point zero point one beta",
    "x²": "ex squared", "10³": "ten cubed", "π": "pi", "π²": "pi squared", "≠": "not equal",
}


@pytest.mark.parametrize("written,said", READINGS.items())
def test_a_written_word_is_said_in_words(written, said):
    assert " ".join(spoken_words(written)) == said


def test_punctuation_around_a_word_stays_around_what_is_said():
    assert spoken_words("($42.50),") == ["(forty", "two", "dollars", "and", "fifty", "cents),"]
    assert spoken_words("2024.") == ["twenty", "twenty", "four."]
    assert spoken_words('"45%?"') == ['"forty', "five", 'percent?"']
    # the dot of an abbreviation is its own; the one of "etc." usually ends a sentence too
    assert spoken_words("Dr.") == ["doctor"] and spoken_words("etc.") == ["et", "cetera."]


def test_markdown_marks_around_a_word_are_not_said():
    assert spoken_words("**3") == ["three"] and spoken_words("tips**:") == ["tips:"]
    assert spoken_words("**Note:**") == ["Note:"] and spoken_words("(`code`)") == ["(code)"]
    assert spoken_words("**$5**,") == ["five", "dollars,"]
    # a link's text is said, not its address
    assert spoken_words("[the") == ["[the"] and spoken_words("docs](https://example.com/docs).") == ["docs."]
    assert spoken_words("[**$5**](https://shop.com)") == ["[five", "dollars"]
    assert spoken_words("](x)") == ["](x)"]  # no link text: as written, never an empty word
    # markup alone is left as written; a name's underscores are its own
    assert [spoken_words(w) for w in ("###", "*", "**", "-")] == [["###"], ["*"], ["**"], ["-"]]
    assert spoken_words("snake_case") == ["snake_case"]


@pytest.mark.parametrize("word", ["Hello", "world!", "don't", "well-known", "I", "A", "NASA", "JSON", "NO",
                                  "THE", "am", "—", "...", "'quoted'", "iPhone", "==", "#", "##", "IIII", "hmm",
                                  "snake_case", "wait...what", "Ph.D", "Wi-Fi",
                                  "e-mail", "ASAP", "NATO", "IS", "HOT", "WIN"])
def test_ordinary_words_and_words_read_as_written_come_back_unchanged(word):
    assert spoken_words(word) == [word]


@given(st.from_regex(r"[A-Za-z][a-z]*(?:['-][a-z]+)?[.,;:!?]?", fullmatch=True))
def test_a_word_of_letters_not_all_capitals_is_said_as_written(word):
    core = word.rstrip(".,;:!?")
    if core.isupper() and len(core) > 1:  # an initialism, spelled
        return
    if not any(c in "aeiouy" for c in core.lower()) or len(core) == 1 and core.isupper():
        return  # nothing to say it by, or a letter: spelled ("npm", "B")
    if "-" in core and core.split("-")[0].isupper():
        return  # a letter before a hyphen ("T-shirt")
    if word in ("pm", "vs", "vs."):  # abbreviations
        return
    assert spoken_words(word) == [word]


def test_a_word_longer_than_max_read_chars_is_said_as_written():
    # a client's 10,000-character "word" (text without spaces) costs the engine thread no
    # reading; a long address still is one
    long_address = "https://example.com/" + "a" * 200
    assert spoken_words(long_address) != [long_address] and len(long_address) <= MAX_READ_CHARS
    for word in ("a1" * 5000, "1/" * 5000, "https://example.com/" + "a" * MAX_READ_CHARS):
        assert spoken_words(word) == [word]


def test_cardinals_ordinals_and_years():
    assert cardinal(999_999_999_999) == ("nine hundred ninety nine billion nine hundred ninety nine million "
                                         "nine hundred ninety nine thousand nine hundred ninety nine").split()
    assert cardinal(-12) == ["minus", "twelve"]
    assert [ordinal(n)[-1] for n in (1, 2, 3, 4, 5, 8, 9, 12, 20, 21, 100, 1000)] == [
        "first", "second", "third", "fourth", "fifth", "eighth", "ninth", "twelfth", "twentieth", "first",
        "hundredth", "thousandth"]
    assert year(2010) == ["twenty", "ten"] and year(1066) == ["ten", "sixty", "six"]


@given(st.text(alphabet="0123456789$€£%&#@+=/°:.,-xkKMmsthndrGBaApP]()½₂~±≠π²", min_size=1, max_size=24))
def test_what_is_said_for_a_word_is_at_most_max_expansion_times_its_length(word):
    # the engine sizes the guidance's transcript ring for the text's characters times this
    assert len(" ".join(spoken_words(word))) <= MAX_EXPANSION * len(word)
    assert all(w and not any(c.isspace() for c in w) for w in spoken_words(word))


MARKS = st.text(alphabet="*`_~", max_size=3)


@given(MARKS, st.from_regex(r"[A-Za-z0-9$%.,:]{0,8}", fullmatch=True), MARKS)
def test_marks_around_a_word_never_reach_the_model(before, core, after):
    said = spoken_words(before + core + after)
    if (before or after) and not any(c.isalnum() for c in core):  # marks and punctuation alone: as written
        assert said == [before + core + after]
        return
    assert not any(c in w for w in said for c in "*`_~")
